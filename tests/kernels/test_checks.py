"""Every TORCH_CHECK of the CPU kernels hands TORCH_CHECK one message string.

With several message arguments TORCH_CHECK formats them through an ostringstream built in the
kernels' library; on one machine (Ubuntu 24.04's g++ 13.3, torch 2.11.0+cu130) every such
failed check killed the process with SIGSEGV, while single-string messages raised. Messages
with values go through PDSERVE_CHECK (kernels/csrc/ops.h), which formats them with snprintf.
"""
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"
LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')


def calls(text: str, name: str):
    """(line, argument text) of each call of the macro `name` in C++ source `text`."""
    for m in re.finditer(rf"\b{name}\(", text):
        depth, i = 1, m.end()
        while depth:
            if text[i] == '"':
                i = LITERAL.match(text, i).end()
                continue
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield text.count("\n", 0, m.start()) + 1, text[m.end():i - 1]


def top_level_args(args: str) -> list[str]:
    """The arguments split at the commas outside brackets and string literals."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(args):
        c = args[i]
        if c == '"':
            i = LITERAL.match(args, i).end()
            continue
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(c, 0)
        if c == "," and depth == 0:
            out.append(args[start:i])
            start = i + 1
        i += 1
    out.append(args[start:])
    return [a.strip() for a in out]


def only_literals(arg: str) -> bool:
    return bool(arg) and not LITERAL.sub("", arg).strip()


def test_every_torch_check_message_is_one_string():
    found, bad = 0, []
    for path in sorted(CSRC.glob("*.*")):
        for line, args in calls(path.read_text(), "TORCH_CHECK"):
            found += 1
            parts = top_level_args(args)
            if parts == ["false", "static_cast<const char*>(pdserve_message_)"]:
                continue  # PDSERVE_CHECK's own: its buffer, one C string
            if len(parts) != 2 or not only_literals(parts[1]):
                bad.append(f"{path.name}:{line}: TORCH_CHECK({' '.join(args.split())[:90]}")
    assert found > 20  # the scan sees the checks
    assert not bad, "use PDSERVE_CHECK for messages with values:\n" + "\n".join(bad)


def test_the_scan_tells_one_string_from_several_arguments():
    def ok(src):
        return all(len(p := top_level_args(a)) == 2 and only_literals(p[1])
                   for _, a in calls(src, "TORCH_CHECK"))

    assert ok('TORCH_CHECK(a.size(0) == f(1, 2), "one, message " "in two (parts)");')
    assert not ok('TORCH_CHECK(x > 0, "x is ", x);')
    assert not ok('TORCH_CHECK(t.dim() == 2, name, ": a [rows, n] tensor");')
    assert not ok('TORCH_CHECK(ok);')
