"""KV transfer between workers: the transports (shm, tcp, nccl, cuda_ipc) behind one interface
(base.py), chosen by name (registry.py)."""

# every transport a worker may offer, by name; torch-free, for the command lines' checks
KNOWN_TRANSPORTS = ("shm", "tcp", "nccl", "cuda_ipc")
