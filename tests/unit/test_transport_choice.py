from common.kv_layout import KVLayout
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.worker_state import transport_between as _transport
from services.scheduler.worker_state import WorkerState


def _w(host, transports):
    return WorkerState(worker_id=host, role="decode", fingerprint="f",
                       layout=KVLayout(1, 1, 4, 4, "float32"), max_model_len=0,
                       transports=tuple(transports), kv=KVCacheManager(4, 4), host_id=host)


def test_shared_memory_only_between_workers_of_one_host():
    assert _transport(_w("a", ["shm", "tcp"]), _w("a", ["shm", "tcp"])) == "shm"
    assert _transport(_w("a", ["shm", "tcp"]), _w("b", ["shm", "tcp"])) == "tcp"
    assert _transport(_w("a", ["tcp", "shm"]), _w("a", ["shm", "tcp"])) == "tcp"  # sender's pick
    assert _transport(_w("a", ["shm"]), _w("b", ["shm", "tcp"])) == ""  # no way across hosts
