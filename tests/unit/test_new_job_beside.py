"""A job's damaged or missing state: what each file's damage calls for, the refusal of a worker
whose record names another job, the line of a new job started beside what another job left, and
the line of a saved job that a scheduler of another worker count or job secret cannot resume.

Following the scheduler's advice for a damaged scheduler.json (move it away) used to leave a job
that could never form: the new job's scheduler refused every worker that read its own record of
the old job, in a refusal cut off mid-sentence that blamed a shared path. Real files here."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.errors import StateFileError
from cluster.protocol.records import Refusal
from cluster.protocol.state_url import parse_state_url
from cluster.scheduler import stores
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.machine import snapshot
from cluster.storage import kv_log, store
from cluster.storage.directory_store import DirectoryStore
from cluster.storage.kv_log import KvLog
from cluster.storage.state_store import StateStore
from cluster.worker import node_file
from tests.conftest import FakeClock
from tests.unit.test_persist import SETTINGS
from tests.unit.test_state import JOB, make_state, refuse, reg

OLD = "f139old0job0"


def record(directory: Path, node_id: str, job: str = OLD, *, finished: bool = False) -> Path:
    node_file.save(directory, node_file.NodeRecord(job, node_id, int(node_id), 1, finished))
    return node_file.path_for(directory, node_id)


def test_the_foreign_job_refusal_is_whole_and_names_the_record_to_move_away() -> None:
    state = make_state(FakeClock(), recovery=True)  # a job beside another's files recovers
    refusal = refuse(state, reg(state, "1", cluster_id=OLD), Refusal.FOREIGN_JOB)
    message = refusal.message
    assert f"node '1' belongs to job {OLD}, but this scheduler runs job {JOB}" in message
    # Where the old job id came from, and what to do when the path is this job's own ...
    assert "its record, worker-1.json in the MS_RECOVERY_PATH of its host" in message
    assert "is this job's own" in message
    assert "move that record away and start the node again: it joins this job" in message
    # ... or shared with another job; and the sentence ends whole.
    assert "give each job its own MS_RECOVERY_PATH (mscluster run --recovery-path)" in message
    assert message.endswith("start the node again with this job's own directory")


def torn(path: Path, load: Callable[[], object]) -> str:
    """The one line of `load()` once the file at `path` is cut short."""
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(StateFileError) as caught:
        load()
    message = str(caught.value)
    assert f"the recovery state {path} is truncated or corrupt" in message
    assert "\n" not in message
    return message


def test_a_damaged_scheduler_state_says_to_move_the_whole_directory_away(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.json"
    store.save(path, "scheduler", {"cluster_id": OLD})
    message = torn(path, lambda: store.load(path, "scheduler"))
    assert message.endswith(store.FILE_ADVICE)
    assert "restore it from a backup" in message
    assert "move the whole MS_RECOVERY_PATH directory away to start a new job" in message
    assert "worker-<id>.json, name this job" in message


def test_a_damaged_worker_record_says_moving_it_away_lets_the_node_rejoin(tmp_path: Path) -> None:
    message = torn(record(tmp_path, "1"), lambda: node_file.load(tmp_path, "1"))
    assert message.endswith(store.NODE_FILE_ADVICE)
    assert "rejoins the job its scheduler runs" in message
    assert "directory" not in message  # the scheduler's advice is not this file's


def test_what_another_job_left_is_named_by_file_and_job(tmp_path: Path) -> None:
    log = KvLog(tmp_path)
    log.reset(OLD)
    log.append(OLD, {"k": b"v"})
    log.close()
    for node_id in ("0", "1", "2", "3"):
        record(tmp_path, node_id)
    record(tmp_path, "4", "other0job000")
    record(tmp_path, "5", finished=True)  # a finished node's record is not presented
    (tmp_path / "worker-6.json").write_bytes(b"torn")  # its worker reports it
    assert store.left_behind(tmp_path) == (
        f"kv.log (job {OLD})",
        f"worker-0.json, worker-1.json and 2 more (job {OLD})",
        "worker-4.json (job other0job000)",
    )
    assert store.left_behind(tmp_path / "none") == ()


async def test_a_new_job_beside_another_jobs_files_says_so_and_keeps_the_records(
    tmp_path: Path,
) -> None:
    """No scheduler.json, but the kv.log and worker records of another job: the new job's
    scheduler says in one line what it found and what it does with each (it empties the
    key-value store for its job; it keeps the records, whose workers it refuses)."""
    log = KvLog(tmp_path)
    log.reset(OLD)
    log.append(OLD, {"k": b"v"})
    log.close()
    records = [record(tmp_path, "0"), record(tmp_path, "1")]
    kept = [path.read_bytes() for path in records]
    state_store = DirectoryStore(tmp_path)
    await state_store.acquire()
    try:
        core = await SchedulerCore.resume(SETTINGS, state_store)
        await core.save_first()
        note = core.restored_note
        assert "\n" not in note
        assert note.startswith(f"starting a new job {core.state.cluster_id}: there is no ")
        assert f"{tmp_path / 'scheduler.json'}, but MS_RECOVERY_PATH holds" in note
        assert f"kv.log (job {OLD}); worker-0.json and worker-1.json (job {OLD})" in note
        assert "the key-value store there is this job's now (empty" in note
        assert "a worker that reads one of those records presents that job and is refused" in note
        assert await state_store.load_kv(core.state.cluster_id) == {}  # emptied, as said
    finally:
        await state_store.close()
    assert [path.read_bytes() for path in records] == kept  # kept, as said


async def test_a_new_job_in_an_empty_directory_says_nothing_more(tmp_path: Path) -> None:
    state_store = DirectoryStore(tmp_path)
    await state_store.acquire()
    try:
        core = await SchedulerCore.resume(SETTINGS, state_store)
        assert core.restored_note == ""
    finally:
        await state_store.close()


async def a_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> StateStore:
    """A held store of `kind`: MS_RECOVERY_PATH on `tmp_path`, or a prefix of a real etcd."""
    if kind == "directory":
        made: StateStore = DirectoryStore(tmp_path)
    else:
        url = parse_state_url(request.getfixturevalue("etcd_cluster").state_url())
        made = await stores.open_etcd(url, "127.0.0.1:1", lease_s=2)
    assert await made.acquire() is None
    return made


@pytest.mark.parametrize("kind", ["directory", "etcd"])
@pytest.mark.parametrize(
    ("changed", "resumes"),
    [
        ({"worker_num": 3}, "restart it with the job's values; "),
        ({"job_secret": b"b" * 32}, "start this scheduler with that job's secret; "),
    ],
    ids=["worker-count", "job-secret"],
)
async def test_a_state_another_setting_cannot_resume_says_how_to_resume_or_start_anew(
    kind: str,
    changed: dict[str, Any],
    resumes: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """The saved job of 2 workers, a scheduler started with another worker count or secret:
    the line says what setting resumes it, and that a new job starts on a state of its own
    with the workers' records moved away (moving scheduler.json away alone starts a job that
    refuses every worker reading its record of the saved job, for ever)."""
    saved = snapshot.save(make_state(FakeClock(), worker_num=2))
    state_store = await a_store(kind, tmp_path, request)
    try:
        assert (await state_store.save(saved, "")).ok
        settings = dataclasses.replace(SETTINGS, **changed)
        with pytest.raises(StateFileError) as caught:
            await SchedulerCore.resume(settings, state_store)
    finally:
        await state_store.close()
    message = str(caught.value)
    assert "\n" not in message
    where = state_store.where
    assert f"the recovery state {where} cannot be resumed: it holds job {JOB}" in message
    assert resumes in message
    assert "move it away" not in message
    if kind == "directory":
        assert message.endswith(store.NEW_JOB_ADVICE)
        assert "move the whole MS_RECOVERY_PATH directory away" in message
    else:
        assert "give it a prefix of its own in CLUSTER_STATE_URL" in message
    assert "on every host" in message or "of every host" in message
    assert "worker-<id>.json" in message


# Each state file: its name, what a refusal calls it, how it is read, what its damage calls for.
STATE_FILES: dict[str, tuple[str, str, Callable[[Path], object], str]] = {
    "scheduler": (
        "scheduler.json",
        "the recovery state",
        lambda d: store.load(d / "scheduler.json", "scheduler"),
        store.FILE_ADVICE,
    ),
    "worker": (
        "worker-1.json",
        "the recovery state",
        lambda d: node_file.load(d, "1"),
        store.NODE_FILE_ADVICE,
    ),
    "kv": ("kv.log", "the key-value log", lambda d: KvLog(d).load(OLD), kv_log.ADVICE),
}


def loaded_at_once(load: Callable[[Path], object], directory: Path, path: Path) -> None:
    """`load(directory)`, which must end within seconds whatever is at `path` (a FIFO there
    held the reading process for ever); a writer opened then lets a waiting open go."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(load, directory)
        try:
            loading.result(timeout=10)
        finally:
            with contextlib.suppress(OSError):  # (ENXIO: none waits)
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("there", ["link", "directory", "fifo"])
@pytest.mark.parametrize("kind", sorted(STATE_FILES))
def test_a_state_file_that_cannot_be_read_says_what_it_is_and_what_to_do(
    tmp_path: Path, there: str, kind: str
) -> None:
    """A symbolic link (to a whole file elsewhere), a directory, or a FIFO where a state file
    goes: the one line names the file and what is there (a link as a link: the system's words
    are "Too many levels of symbolic links"; a FIFO is never waited on) and ends with that
    file's advice, as a torn file's does (it ended with the system's cause, saying nothing of
    what to do)."""
    name, what, load, advice = STATE_FILES[kind]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    record(elsewhere, "1")
    store.save(elsewhere / "scheduler.json", "scheduler", {"cluster_id": OLD})
    KvLog(elsewhere).reset(OLD)
    directory = tmp_path / "recovery"
    directory.mkdir()
    path = directory / name
    if there == "link":
        path.symlink_to(elsewhere / name)
        said = f"{what} {path} is a symbolic link, which is never followed: put the file itself"
    elif there == "directory":
        path.mkdir()
        said = f"cannot read {what} {path} (a directory, not a regular file): make it a file"
    else:
        os.mkfifo(path)
        said = f"cannot read {what} {path} (a FIFO, not a regular file): make it a file"
    with pytest.raises(StateFileError) as caught:
        loaded_at_once(load, directory, path)
    message = str(caught.value)
    assert said in message
    assert message.endswith(f", or {advice}")
    assert "\n" not in message
