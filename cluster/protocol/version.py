"""Which `cluster` a process runs: the release, and the revision of the protocol it speaks.

`VERSION` is the release (`cluster.__version__`, and the package's version in pyproject.toml).
`PROTOCOL_REVISION` numbers the protocol between the processes of one job: the wire
(protos/cluster/v1, the local hop between a relay and its workers included) and what a scheduler
saves of its job (the state file, the etcd keys). Bump it, here and only here, with every change
that a process of the previous revision would read wrongly: a field whose absence an older peer
misreads, a new meaning of an enum value or of a saved key, a saved state an older scheduler
cannot resume. A change that older processes read correctly (a new field an older one may
ignore) keeps it: two releases of one revision work together.

A worker sends both with its registration (`RegisterRequest.protocol_revision`,
`cluster_version`), a host's relay with its own calls to the scheduler (call metadata
`METADATA_KEY`), and a scheduler writes both into the state it saves. A scheduler refuses a
registration, a relay and a saved state of another revision, in one line naming both releases
and what to do; with a job secret, a registration that does not prove it and a relay are told
the line without this scheduler's release, which the scheduler's log names (`refusal`). What
names no revision was made before revisions were named: it is revision 1 (`revision_of`,
`stamped`). What each revision changed: docs/design/architecture.md.
"""

from __future__ import annotations

VERSION = "0.1.0"
PROTOCOL_REVISION = 3
# The revision of a process or a state that does not say (made before revisions were sent).
UNSTATED_REVISION = 1
# The most characters of a release a peer may name (`cluster.transport.edge`).
MAX_VERSION_CHARS = 64
# The call metadata in which a host's relay names its revision and release, "REVISION RELEASE"
# (`stamp`), on its own calls to the scheduler (HostWatch, HostBeats).
METADATA_KEY = "cluster-release"


def stamp() -> str:
    """This process's revision and release, as `METADATA_KEY` carries them."""
    return f"{PROTOCOL_REVISION} {VERSION}"


def stamped(value: str | None) -> tuple[int, str]:
    """The revision and release a `stamp` names; None (no stamp: a relay from before stamps
    were sent) is revision 1 without a release, and a revision that is not a number is -1."""
    if value is None:
        return UNSTATED_REVISION, ""
    revision, _, release = value.partition(" ")
    if not (revision.isascii() and revision.isdecimal() and len(revision) <= 9):
        return -1, release
    return int(revision), release


def revision_of(sent: int) -> int:
    """The revision a peer runs, from what it sent (0: nothing)."""
    return sent or UNSTATED_REVISION


def describe(release: str, revision: int) -> str:
    """A release as a message names it: "cluster 0.1.0 (protocol revision 1)"; without one (a
    peer or a state from before releases were named), "an older cluster ..."."""
    named = f"cluster {release}" if release else "an older cluster that does not name its version"
    return f"{named} (protocol revision {revision})"


# What a refusal of another revision asks for.
SAME_VERSION_ADVICE = (
    "start every process of the job (schedulers, relays, workers) from the same version of cluster"
)
# What a scheduler runs: its release and protocol revision.
RUNS = (VERSION, PROTOCOL_REVISION)


def mismatch(who: str, release: str, revision: int, runs: tuple[str, int] = RUNS) -> str | None:
    """Why a scheduler that `runs` (its release and revision) refuses `who` (a node, a host's
    relay), which runs `release` of protocol `revision`: the line; None when the revisions are
    the same, whatever the releases."""
    if revision == runs[1]:
        return None
    return (
        f"{who} runs {describe(release, revision)}, but this scheduler runs {describe(*runs)}: "
        f"{SAME_VERSION_ADVICE}"
    )


def refusal(
    who: str, release: str, revision: int, runs: tuple[str, int] = RUNS, *, unproven: str = ""
) -> tuple[str, str] | None:
    """What `who` is told and what the scheduler logs when it refuses `who` (`mismatch`); None
    when the revisions are the same. `unproven`: why `who` has not shown that it belongs to
    the job, which has a secret (it did not prove the secret; a relay proves none of its own).
    The line `who` is told then names `who`'s release and not this scheduler's, which only a
    member learns (and the scheduler's operator, from its log); without it, both lines are
    `mismatch`'s."""
    line = mismatch(who, release, revision, runs)
    if line is None or not unproven:
        return None if line is None else (line, line)
    named = "it names its own release only to a process that proves the job secret"
    told = (
        f"{who} runs {describe(release, revision)}, which this scheduler does not speak; "
        f"{named} (CLUSTER_JOB_SECRET_FILE or CLUSTER_JOB_SECRET), {unproven}, and in its own "
        f"log: {SAME_VERSION_ADVICE}"
    )
    return told, f"{line}; told without this scheduler's release: {named}, {unproven}"
