"""Permissions and other users (issue 12 §7): gc and the local directory trust nothing found in
the shared segment directory, never fail a Runtime start over it, and remove the leftovers of
deaths at any instant (tmp records, dangling names, empty job folders).

Every test runs in a segment directory of its own (``MEMSEM_SHM_DIR``) made like ``/dev/shm``
(root-owned, mode 1777). Other users are real: files are chowned to another uid, and the
victim-side tests run a forked child under another uid (``os.setuid``). They need root; they skip
without it, except under CI (``CI`` set), where they fail.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import memsem
from memsem.directory.local import LocalDirectory
from memsem.native import node_id, process_start_time
from memsem.core import collect
from tests._agent import Agent
from tests.conftest import SPAWN

ATTACKER = 42421
VICTIM = 42422


@pytest.fixture
def root():
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("these tests need root (other users are simulated with chown/setuid); CI runs as root")
        pytest.skip("needs root to act as other users")


@pytest.fixture
def shm(monkeypatch, tmp_path_factory):
    """A private segment directory shaped like /dev/shm: root-owned, world-writable, sticky."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path_factory.getbasetemp())
    path = os.path.join(base, f"memsem-gc-test-{secrets.token_hex(6)}")
    os.mkdir(path)
    os.chmod(path, 0o1777)
    monkeypatch.setenv("MEMSEM_SHM_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


def _plant(path: str, data: bytes = b"", uid: int | None = None, mode: int = 0o600) -> str:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def _seg_name(uid: int, pid: int, start: int = 1, kind: str = "data") -> str:
    return f"memsem.{uid}.{kind}.{pid}-{start}.{secrets.token_hex(16)}"


def _skipped(report, path: str) -> str | None:
    return next((why for p, why in report.skipped if p == path), None)


def _exercise(job: str | None = None) -> None:
    """A Runtime starts and works: publish, a second runtime resolves and reads."""
    with memsem.Runtime(timeout=5.0, job=job) as rt:
        ref = rt.publish(np.arange(32, dtype=np.int64), name="probe")
        with memsem.Runtime(timeout=5.0, job=job) as other:
            assert (other.ref(ref.to_bytes()).get() == np.arange(32)).all()


# -- planted files in the segment directory ---------------------------------------------------
def test_plants_of_other_users_are_skipped_and_runtime_starts(root, shm):
    uid = os.getuid()
    dead = _dead_pid()
    foreign_seg = _plant(os.path.join(shm, _seg_name(uid, dead)), b"x", uid=ATTACKER)
    target = _plant(os.path.join(shm, "not-memsem-target"), b"keep me")
    link_seg = os.path.join(shm, _seg_name(uid, dead))
    os.symlink(target, link_seg)
    foreign_dir = os.path.join(shm, f"memsem.{uid}.dir.foreign")
    os.mkdir(foreign_dir, 0o700)
    _plant(os.path.join(foreign_dir, "r.0"), json.dumps({"pid": dead, "start": 1, "node": node_id()}).encode())
    os.chown(foreign_dir, ATTACKER, ATTACKER)
    elsewhere = os.path.join(shm, "elsewhere")
    os.mkdir(elsewhere, 0o700)
    bait = _plant(os.path.join(elsewhere, "r.0"), json.dumps({"pid": dead, "start": 1, "node": node_id()}).encode())
    link_dir = os.path.join(shm, f"memsem.{uid}.dir.linked")
    os.symlink(elsewhere, link_dir)
    odd = _plant(os.path.join(shm, f"memsem.{uid}.odd-name"), b"?")
    fifo = os.path.join(shm, _seg_name(uid, dead))
    os.mkfifo(fifo, 0o600)

    report = collect()
    assert "owned by uid 42421" in _skipped(report, foreign_seg)
    assert "symlink" in _skipped(report, link_seg)
    assert "owned by uid 42421" in _skipped(report, foreign_dir)
    assert "symlink" in _skipped(report, link_dir)
    assert "not a memsem segment name" in _skipped(report, odd)
    assert "not a regular file" in _skipped(report, fifo)
    for p in (foreign_seg, link_seg, foreign_dir, link_dir, odd, fifo, bait):
        assert os.path.lexists(p), f"gc removed {p}"
    assert open(target, "rb").read() == b"keep me" and os.path.exists(bait)
    _exercise()  # Runtime start (which runs gc) is not stopped by any of it
    assert os.path.lexists(foreign_seg) and os.path.exists(bait)


@pytest.mark.parametrize("plant", ["symlink", "foreign", "mode0755", "file", "symlink_to_own_folder"])
def test_local_directory_refuses_an_untrusted_job_folder(root, shm, plant):
    uid = os.getuid()
    path = os.path.join(shm, f"memsem.{uid}.dir.victim")
    other = os.path.join(shm, "real-folder")
    os.mkdir(other, 0o700)
    if plant == "symlink":
        os.symlink(other, path)
    elif plant == "symlink_to_own_folder":  # even a link to a folder that would pass the checks
        os.symlink(other, path)
    elif plant == "foreign":
        os.mkdir(path, 0o700)
        os.chown(path, ATTACKER, ATTACKER)
    elif plant == "mode0755":
        os.mkdir(path, 0o755)
    else:
        _plant(path, b"")
    with pytest.raises(memsem.AccessDeniedError, match=rf"directory {path} ") as ei:
        memsem.Runtime(timeout=5.0, job="victim")
    assert isinstance(ei.value, PermissionError)
    assert os.listdir(other) == []  # nothing was written through the link
    assert os.path.lexists(path)
    _exercise(job="fine")  # other jobs are unaffected


def test_folder_swapped_for_a_symlink_after_open_is_not_followed(root, shm):
    """Operations go through the folder's descriptor: renaming the folder away and planting a
    symlink in its place after the runtime opened it redirects nothing."""
    with memsem.Runtime(timeout=5.0, job="swap") as rt:
        path = rt.directory.path
        moved = path + ".moved"
        os.rename(path, moved)
        trap = os.path.join(shm, "trap")
        os.mkdir(trap, 0o700)
        os.symlink(trap, path)
        ref = rt.publish(np.ones(8, np.float32), name="after-swap")
        assert os.listdir(trap) == []
        assert any(f.startswith("w.") for f in os.listdir(moved))
        assert (ref.get() == 1).all()
        os.unlink(path)
        os.rename(moved, path)


# -- unparseable records in our own job folder ------------------------------------------------
def test_unparseable_records_are_skipped_and_runtime_starts(root, shm):
    with memsem.Runtime(timeout=5.0, job="garbage") as rt:
        folder = rt.directory.path
        ref = rt.publish(np.arange(16, dtype=np.float32), name="good")
        gva = ref.spec.gva
        plants = {
            "r.77": b"{not json", "r.78": b"[1, 2, 3]", "r.79": json.dumps({"pid": "x"}).encode(),
            "r.80": b"\xff\xfe", "r.x1": b"{}",
            f"w.{gva + (1 << 16):016x}": b"garbage", f"w.{gva + (2 << 16):016x}": json.dumps({"gva": "x"}).encode(),
            f"w.{gva + (3 << 16):016x}": json.dumps([1]).encode(), "w.zz": b"{}",
            f"n.{b'bad'.hex()}": b"not hex", "junk": b"?", ".tmp.weird": b"",
            f"k.{b'e/x'.hex()}": b"{broken",
        }
        for name, data in plants.items():
            _plant(os.path.join(folder, name), data)
        os.symlink("/etc/passwd", os.path.join(folder, "r.81"))
        os.mkdir(os.path.join(folder, f"w.{gva + (4 << 16):016x}"))
        big = _plant(os.path.join(folder, f"w.{gva + (5 << 16):016x}"), b" " * (2 << 20))

        report = collect()
        for name in [n for n in plants if not n.startswith("k.")] + ["r.81", f"w.{gva + (4 << 16):016x}"]:
            why = _skipped(report, os.path.join(folder, name))
            assert why is not None, f"{name} not reported as skipped: {report.skipped}"
        assert "more than" in _skipped(report, big) or "has" in _skipped(report, big)
        for name in plants:
            assert os.path.lexists(os.path.join(folder, name)), f"gc removed {name}"
        assert open("/etc/passwd", "rb").read(1)  # the link target is untouched

        # The directory's own listings skip them; new runtimes of the job start and resolve.
        assert [w["gva"] for w in rt.directory.windows()] == [gva]
        assert set(rt.directory.ranks()) == {rt.rank}
        with memsem.Runtime(timeout=5.0, job="garbage") as other:
            assert other.rank not in (77, 78, 79, 80, 81)
            assert (other.ref(ref.to_bytes()).get() == np.arange(16)).all()
            assert other.directory.entries("e/") == {}
        cli = subprocess.run([sys.executable, "-m", "memsem.cli", "gc", "--dry-run"], capture_output=True,
                             text=True, timeout=60, env=dict(os.environ))
        assert cli.returncode == 0, cli.stderr
        assert any(line.startswith("skipped ") and "r.77" in line for line in cli.stdout.splitlines()), cli.stdout


def test_collect_never_raises(root, shm, monkeypatch):
    """Whatever the segment directory holds, including a folder that cannot be listed."""
    uid = os.getuid()
    locked = os.path.join(shm, f"memsem.{uid}.dir.locked")
    os.mkdir(locked, 0o700)
    os.chmod(locked, 0o000)
    try:
        collect()
        monkeypatch.setenv("MEMSEM_SHM_DIR", os.path.join(shm, "does-not-exist"))
        report = collect()
        assert report == [] and "cannot open" in report.skipped[0][1]
    finally:
        os.chmod(locked, 0o700)


# -- leftovers gc must remove -----------------------------------------------------------------
def _job_folder(shm: str, job: str) -> str:
    path = os.path.join(shm, f"memsem.{os.getuid()}.dir.{job}")
    os.mkdir(path, 0o700)
    return path


def test_tmp_records_of_dead_writers_are_removed(root, shm):
    folder = _job_folder(shm, "tmp")
    d = LocalDirectory("tmp", alive=lambda rec: True)
    pid = os.fork()
    if pid == 0:  # a writer that dies between write and rename
        try:
            d._write_tmp({"half": "written"})
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    theirs = [f for f in os.listdir(folder) if f.startswith(f".tmp.{pid}-")]
    assert len(theirs) == 1
    mine = d._write_tmp("in progress")  # a live writer's: kept
    assert mine.startswith(f".tmp.{os.getpid()}-{process_start_time(os.getpid())}.")
    old_legacy = _plant(os.path.join(folder, f".tmp.{secrets.token_hex(8)}"))
    os.utime(old_legacy, (time.time() - 3600, time.time() - 3600))
    new_legacy = _plant(os.path.join(folder, f".tmp.{secrets.token_hex(8)}"))

    report = collect()
    removed = {os.path.basename(p) for p, _ in report}
    assert theirs[0] in removed and os.path.basename(old_legacy) in removed
    assert set(os.listdir(folder)) == {mine, os.path.basename(new_legacy)}
    d._unlink(mine)
    d.close()


def test_dangling_names_after_a_death_mid_republish_are_removed(root, shm):
    folder = _job_folder(shm, "names")
    me = node_id()
    dead = _dead_pid()
    gva_dead = (5 << 44) | (1 << 16)     # rank 5: a dead owner whose rank record remains
    gva_gone = (6 << 44) | (1 << 16)     # rank 6: no rank record at all any more
    gva_live = (7 << 44) | (1 << 16)     # rank 7: a live owner between its two writes
    _plant(os.path.join(folder, "r.5"), json.dumps({"pid": dead, "start": 99, "node": me}).encode())
    _plant(os.path.join(folder, "r.7"), json.dumps({"pid": os.getpid(), "start": process_start_time(os.getpid()),
                                                     "node": me}).encode())
    for name, gva in (("a", gva_dead), ("b", gva_gone), ("c", gva_live)):
        _plant(os.path.join(folder, f"n.{name.encode().hex()}"), f"{gva:016x}".encode())
    report = collect()
    removed = {os.path.basename(p) for p, _ in report}
    assert {"r.5", f"n.{b'a'.hex()}", f"n.{b'b'.hex()}"} <= removed, report
    assert set(os.listdir(folder)) == {"r.7", f"n.{b'c'.hex()}"}


def test_real_owner_killed_leaves_no_records(root, shm):
    """A real owner publishes named windows and is SIGKILLed; its window record of one name is
    gone already (as after a death between the two removals of a republish): the next Runtime
    start removes every record of it, and the folder once nothing is left."""
    job = "killed"
    owner = Agent(SPAWN, job=job, timeout=5.0)
    try:
        owner.call("publish", 1, 4096, True, "rw", "one")
        owner.call("publish", 2, 4096, False, "rw", "two")
        folder = os.path.join(shm, f"memsem.{os.getuid()}.dir.{job}")
        owner.kill()
        w_two = [f for f in os.listdir(folder) if f.startswith("w.")]
        for f in w_two[:1]:
            os.unlink(os.path.join(folder, f))
        assert any(f.startswith("n.") for f in os.listdir(folder))
        collect()
        assert not os.path.exists(folder), os.listdir(folder) if os.path.exists(folder) else None
        assert [n for n in os.listdir(shm) if f".{owner.pid}-" in n] == []
    finally:
        owner.kill()


def test_empty_job_folders_are_removed(root, shm):
    in_use = memsem.Runtime(timeout=5.0, job="inuse")  # its start runs gc: plant afterwards
    empty = _job_folder(shm, "empty")
    dead_only = _job_folder(shm, "deadonly")
    _plant(os.path.join(dead_only, "r.0"), json.dumps({"pid": _dead_pid(), "start": 5, "node": node_id()}).encode())
    try:
        report = collect(dry_run=True)
        assert (empty, "empty job folder") in report and (dead_only, "empty job folder") in report
        assert os.path.isdir(empty)  # dry run removed nothing
        report = collect()
        assert (empty, "empty job folder") in report and (dead_only, "empty job folder") in report
        assert not os.path.exists(empty) and not os.path.exists(dead_only)
        assert os.path.isdir(in_use.directory.path)
    finally:
        in_use.close()
    assert not os.path.exists(in_use.directory.path)  # its last user removed it


def test_rank_claims_are_never_torn(root, shm):
    """Rank records appear whole (hard link of a complete temporary file): a concurrent reader
    never takes a half-written claim for a dead owner and reaps it."""
    d = LocalDirectory("claims", alive=lambda rec: True)
    try:
        ranks = [d.claim_rank({"pid": os.getpid(), "start": process_start_time(os.getpid()), "node": node_id(),
                               "pad": "x" * 4096}) for _ in range(20)]
        assert ranks == list(range(20))
        assert all(len(json.loads(open(os.path.join(d.path, f"r.{r}")).read())["pad"]) == 4096 for r in ranks)
        assert [f for f in os.listdir(d.path) if f.startswith(".tmp.")] == []
    finally:
        for r in range(20):
            d.release_rank(r)
        d.close()


# -- the victim is another user: real EPERM ---------------------------------------------------
def _as_user(uid: int, fn) -> dict:
    """Run ``fn()`` in a forked child under ``uid``; returns its JSON result (or its error)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = {"ok": fn()}
        except BaseException as exc:  # reported to the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def test_victim_user_is_not_stopped_by_an_attackers_plants(root, shm):
    """The issue's attack: another local user plants files named like the victim's (a dead
    segment name it cannot remove in the sticky directory, its default job folder, a symlinked
    job folder, garbage). The victim's gc skips them; its Runtime() starts (a planted folder of
    the very job it opens is refused with a clear error naming the path)."""
    dead = _dead_pid()
    planted_seg = _plant(os.path.join(shm, _seg_name(VICTIM, dead)), b"x", uid=ATTACKER)
    planted_job = os.path.join(shm, f"memsem.{VICTIM}.dir.default")
    os.mkdir(planted_job, 0o700)
    os.chown(planted_job, ATTACKER, ATTACKER)
    attacker_dir = os.path.join(shm, "attacker")
    os.mkdir(attacker_dir, 0o777)
    os.chown(attacker_dir, ATTACKER, ATTACKER)
    os.symlink(attacker_dir, os.path.join(shm, f"memsem.{VICTIM}.dir.linked"))

    def victim():
        report = collect()
        out = {"skipped": [[os.path.basename(p), why] for p, why in report.skipped]}
        with memsem.Runtime(timeout=5.0, job="work") as rt:
            ref = rt.publish(np.arange(8, dtype=np.float32))
            with memsem.Runtime(timeout=5.0, job="work") as other:
                out["read"] = other.ref(ref.to_bytes()).get().tolist()
        for job in ("default", "linked"):
            try:
                memsem.Runtime(timeout=5.0, job=job).close()
                out[job] = "started"
            except memsem.AccessDeniedError as exc:
                out[job] = str(exc)
        return out

    res = _as_user(VICTIM, victim)
    assert "ok" in res, res
    out = res["ok"]
    skipped = dict(out["skipped"])
    assert "owned by uid 42421" in skipped[os.path.basename(planted_seg)]
    assert "owned by uid 42421" in skipped[os.path.basename(planted_job)]
    assert "symlink" in skipped[f"memsem.{VICTIM}.dir.linked"]
    assert out["read"] == list(range(8))
    assert planted_job in out["default"] and "owned by uid" in out["default"]
    assert "symlink" in out["linked"]
    assert os.listdir(attacker_dir) == [] and os.path.exists(planted_seg)


def test_unremovable_dead_segment_is_skipped_with_the_reason(root, shm):
    """A dead creator's segment of the victim in a folder where the victim may not unlink (EACCES
    for real, as a non-root user): skipped with the errno's reason, collect does not raise."""
    seg = _plant(os.path.join(shm, _seg_name(VICTIM, _dead_pid())), b"x", uid=VICTIM)
    os.chmod(shm, 0o755)  # root-owned, not writable by the victim

    def victim():
        report = collect()
        return {"removed": [p for p, _ in report], "skipped": report.skipped}

    res = _as_user(VICTIM, victim)
    assert "ok" in res, res
    assert res["ok"]["removed"] == []
    (path, why), = res["ok"]["skipped"]
    assert path == seg and "cannot remove it" in why and "Permission denied" in why
    assert os.path.exists(seg)


def test_a_job_folder_removed_between_its_mkdir_and_its_open_is_made_again(shm, monkeypatch):
    """Another runtime of the job closing removes the empty job folder right after this one's
    mkdir found it (the order forced: the removal runs inside the first open): the folder is
    made again and opened, never FileNotFoundError (a loaded CI run met that order: a trainer
    rank's Runtime() failed to start). A folder removed every time ends in FileNotFoundError
    after OPEN_TRIES, not a loop."""
    from memsem.directory import local

    path = os.path.join(shm, f"memsem.{os.getuid()}.dir.race")
    os.mkdir(path, 0o700)  # the job's folder, empty: its last runtime is closing
    real = local._open_dir
    removed = []

    def open_after_a_removal(p):
        if len(removed) < 3:  # the closing runtime's rmdir lands between mkdir and open
            os.rmdir(p)
            removed.append(p)
        return real(p)

    monkeypatch.setattr(local, "_open_dir", open_after_a_removal)
    d = LocalDirectory("race", alive=lambda rec: True)
    try:
        assert len(removed) == 3 and os.path.isdir(path)
        assert os.fstat(d.fd).st_ino == os.stat(path).st_ino
    finally:
        d.close()

    def always_removed(p):
        os.rmdir(p)
        return real(p)

    monkeypatch.setattr(local, "_open_dir", always_removed)
    with pytest.raises(FileNotFoundError):
        local.open_folder(path, create=True)
    assert not os.path.exists(path)
