"""The benchmark's chat workload: real text, one shared system prompt, mixed lengths, and
multi-turn conversations whose turns extend an earlier request."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import loadgen  # noqa: E402


def test_chat_is_a_named_workload_of_conversations():
    assert "chat" in loadgen.WORKLOADS
    convs = loadgen.workload("chat", 200, seed=3)
    assert convs == loadgen.workload("chat", 200, seed=3) != loadgen.workload("chat", 200, 4)
    for conv in convs:
        assert conv[0] == {"role": "system", "content": loadgen.SYSTEM_PROMPT}
        roles = [m["role"] for m in conv[1:]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert all(m["content"].strip() for m in conv)


def test_chat_lengths_are_mixed_and_turns_share_their_prefix():
    convs = loadgen.workload("chat", 200, seed=0)
    chars = sorted(sum(len(m["content"]) for m in c) for c in convs)
    short, long = chars[len(chars) // 2], chars[-len(chars) // 20]
    assert short < 1000 < 4000 < long  # most a question, the top 5% several sections
    follow_ups = [c for c in convs if len(c) > 2]
    assert 0.2 < len(follow_ups) / len(convs) < 0.4
    for conv in follow_ups:  # each continues an earlier conversation, word for word
        assert conv[:-2] in convs[:convs.index(conv)]
