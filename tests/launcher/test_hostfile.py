"""Hostfile parsing and filters (launcher.hostfile): unit tests, no processes.

The table of bad hostfiles and flags run through the real CLI lives in test_launch_local.py.
"""

from __future__ import annotations

import pytest

from launcher.errors import HostfileError
from launcher.hostfile import parse_hostfile, read_hostfile, select_hosts
from tests.support.paths import REPO

REPO = REPO

GOOD = """\
# cluster
worker-0 slots=4

worker-1 slots=2   # smaller box
  # indented comment
10.0.0.7 slots=0
"""


def test_good_hostfile_keeps_order_comments_and_zero_slots():
    hf = parse_hostfile(GOOD, "hf")
    assert [(e.name, e.slots, e.line) for e in hf.entries] == [
        ("worker-0", 4, 2),
        ("worker-1", 2, 4),
        ("10.0.0.7", 0, 6),
    ]
    # a host with 0 slots is listed but gets no workers
    assert [(s.host, s.slots) for s in select_hosts(hf)] == [("worker-0", (0, 1, 2, 3)), ("worker-1", (0, 1))]


def test_user_and_port_are_kept_and_filters_use_the_bare_name():
    hf = parse_hostfile("root@w0:2222 slots=2\nw1:22 slots=2\nadmin@w2 slots=1\n", "hf")
    assert [(e.host, e.name) for e in hf.entries] == [
        ("root@w0:2222", "w0"),
        ("w1:22", "w1"),
        ("admin@w2", "w2"),
    ]
    selected = select_hosts(hf, include="w0:1@w2")
    assert [(s.host, s.slots) for s in selected] == [("root@w0:2222", (1,)), ("admin@w2", (0,))]


def test_ipv6_hosts_in_brackets_as_openssh_writes_them():
    hf = parse_hostfile("[::1] slots=2\n[fe80::1%eth0]:2222 slots=1\nuser@[2001:db8::7]:22 slots=4\n", "hf")
    assert [(e.host, e.name) for e in hf.entries] == [
        ("[::1]", "[::1]"),
        ("[fe80::1%eth0]:2222", "[fe80::1%eth0]"),
        ("user@[2001:db8::7]:22", "[2001:db8::7]"),
    ]
    # Filters name an IPv6 host with its brackets; the colon after "]" starts the slot list.
    chosen = select_hosts(hf, include="[2001:db8::7]:1,3@[::1]")
    assert [(s.host, s.slots) for s in chosen] == [("[::1]", (0, 1)), ("user@[2001:db8::7]:22", (1, 3))]
    chosen = select_hosts(hf, exclude="[::1]:0@[fe80::1%eth0]")
    assert [(s.host, s.slots) for s in chosen] == [("[::1]", (1,)), ("user@[2001:db8::7]:22", (0, 1, 2, 3))]
    with pytest.raises(HostfileError, match=r"--include '\[::2\]': host '\[::2\]' is not in the hostfile"):
        select_hosts(hf, include="[::2]")
    with pytest.raises(HostfileError, match=r"--include '\[::1\]x': bad host '\[::1\]x'"):
        select_hosts(hf, include="[::1]x")


def test_a_job_left_without_slots_names_the_slots_0_line():
    hf = parse_hostfile("# only a listed host\nworker-0 slots=0\nworker-1 slots=0\n", "hf")
    with pytest.raises(HostfileError) as info:
        select_hosts(hf)
    err = info.value
    assert (err.line, err.text) == (2, "worker-0 slots=0")
    assert str(err) == (
        "hf:2: no slots left to run on: host 'worker-0' has slots=0 (so do 1 more host(s)); "
        "set slots=N (N >= 1): 'worker-0 slots=0'"
    )
    with pytest.raises(HostfileError, match=r"^hf:2: no slots left.*'worker-1' has slots=0"):
        select_hosts(parse_hostfile("worker-0 slots=2\nworker-1 slots=0\n", "hf"), include="worker-1")


def test_shipped_example_hostfiles_parse():
    assert [e.name for e in read_hostfile(str(REPO / "hostfiles" / "localhost")).entries] == ["localhost"]
    two = read_hostfile(str(REPO / "hostfiles" / "two_nodes"))
    assert [(e.name, e.slots) for e in two.entries] == [("worker-0", 8), ("worker-1", 4)]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"include": "worker-1"}, [("worker-1", (0, 1))]),
        ({"include": "worker-0:3,1"}, [("worker-0", (1, 3))]),
        ({"include": "worker-1:0@worker-0:2"}, [("worker-0", (2,)), ("worker-1", (0,))]),
        ({"exclude": "worker-0:0,1"}, [("worker-0", (2, 3)), ("worker-1", (0, 1))]),
        ({"exclude": "worker-0"}, [("worker-1", (0, 1))]),
        ({"num_nodes": 1}, [("worker-0", (0, 1, 2, 3))]),
        ({"num_gpus": 2}, [("worker-0", (0, 1)), ("worker-1", (0, 1))]),
    ],
)
def test_filters(filters, expected):
    hf = parse_hostfile("worker-0 slots=4\nworker-1 slots=2\n", "hf")
    assert [(s.host, s.slots) for s in select_hosts(hf, **filters)] == expected


@pytest.mark.parametrize(
    ("text", "line", "offending", "message"),
    [
        ("a slots=2\nb slotz=2\n", 2, "b slotz=2", "expected 'slots=N'"),
        ("a\n", 1, "a", "missing 'slots=N'"),
        ("a slots=x\n", 1, "a slots=x", "non-negative integer"),
        ("a slots=-1\n", 1, "a slots=-1", "non-negative integer"),
        ("a slots=1\n# c\na slots=2\n", 3, "a slots=2", "already listed on line 1"),
        ("a:ssh slots=1\n", 1, "a:ssh slots=1", "bad host 'a:ssh' (expected [user@]name[:port])"),
        ("u@v@a slots=1\n", 1, "u@v@a slots=1", "bad host 'u@v@a'"),
        ("a:70000 slots=1\n", 1, "a:70000 slots=1", "port 70000 is not a TCP port"),
        (
            "a slots=1\nroot@a:2222 slots=1\n",
            2,
            "root@a:2222 slots=1",
            "host 'a' is already listed on line 1",
        ),
        ("a slots=1 max_slots=2\n", 1, "a slots=1 max_slots=2", "unexpected 'max_slots=2'"),
        ("::1 slots=1\n", 1, "::1 slots=1", "write an IPv6 address in brackets, e.g. [::1] or [::1]:22"),
        ("[gpu1] slots=1\n", 1, "[gpu1] slots=1", "[gpu1] is not an IPv6 address (brackets are for IPv6"),
        ("[::1 slots=1\n", 1, "[::1 slots=1", "bad host '[::1' (expected [user@]name[:port])"),
        ("[::1]:0 slots=1\n", 1, "[::1]:0 slots=1", "port 0 is not a TCP port"),
        ("[::1] slots=1\nroot@[::1]:22 slots=1\n", 2, "root@[::1]:22 slots=1", "already listed on line 1"),
        ("# only\n\n   \n", 0, "", "no hosts"),
    ],
)
def test_bad_hostfiles_name_file_line_and_text(text, line, offending, message):
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text, "my/hostfile")
    err = info.value
    assert (err.file, err.line, err.text) == ("my/hostfile", line, offending)
    assert message in str(err)
    assert str(err).startswith(f"my/hostfile:{line}:" if line else "my/hostfile:")


@pytest.mark.parametrize(
    ("filters", "line", "message"),
    [
        ({"include": "worker-9"}, 0, "host 'worker-9' is not in the hostfile (worker-0, worker-1)"),
        ({"include": "worker-1:2"}, 2, "host 'worker-1' has no slot 2 (slots 0-1)"),
        ({"include": "worker-0:a"}, 1, "slot 'a' is not a slot number"),
        ({"exclude": "worker-0@@worker-1"}, 0, "empty host name"),
        ({"include": "worker-0:1,1"}, 1, "slot 1 is named twice"),
        ({"include": "worker-0", "exclude": "worker-1"}, 0, "and --exclude 'worker-1' cannot be combined"),
        ({"include": "worker-0", "num_gpus": 1}, 0, "--num_gpus cannot be combined with --include"),
        ({"num_gpus": 3}, 2, "--num_gpus 3: host 'worker-1' has only 2 slot(s)"),
        ({"num_nodes": 3}, 0, "lists only 2 host(s)"),
        ({"exclude": "worker-0@worker-1"}, 0, "no slots left"),
    ],
)
def test_bad_filters_are_located(filters, line, message):
    hf = parse_hostfile("worker-0 slots=4\nworker-1 slots=2\n", "hf")
    with pytest.raises(HostfileError) as info:
        select_hosts(hf, **filters)
    assert info.value.line == line
    assert message in str(info.value)
    if line:
        assert info.value.text == hf.entries[line - 1].text
        assert repr(info.value.text) in str(info.value)


def test_missing_hostfile(tmp_path):
    with pytest.raises(HostfileError, match="cannot read the hostfile"):
        read_hostfile(str(tmp_path / "nope"))


def test_a_byte_order_mark_is_not_part_of_the_first_host(tmp_path):
    # Windows editors write one; it used to make the first line "bad host '\ufeffworker-0'"
    path = tmp_path / "hostfile"
    path.write_bytes(b"\xef\xbb\xbfworker-0 slots=2\r\nworker-1 slots=2\r\n")
    assert [(e.name, e.slots) for e in read_hostfile(str(path)).entries] == [("worker-0", 2), ("worker-1", 2)]
