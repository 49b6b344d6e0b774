"""The run's custody record, so a learner killed mid-run resumes without losing or repeating work.

An append-only JSONL file in the run directory (`ledger.jsonl`), one line per event, each
written with one `write` on an O_APPEND descriptor: a `kill -9` loses at most the line being
written (a torn last line is skipped on replay), never an earlier one.

    {"e": "L", "p": [[id, text, answer], ...]}    prompts leased
    {"e": "T", "s": step, "p": [id, ...]}          their groups trained by update `step`
    {"e": "P", "v": version}                       a snapshot published
    {"e": "R", "from": step}                       the learner resumed from the checkpoint of `step`

On `--resume` the learner restores the newest checkpoint (update `c`) and replays the ledger:
every prompt leased but not trained by an update ≤ c is issued again (whatever was in flight,
queued in the lost buffer, or trained by an update the crash rolled back), and version numbers
continue after the newest one ever published, so no number ever names two different snapshots.
Groups acknowledged before the crash are never trained twice: their leases died with the old
process, and an upload into a dead lease is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from echo.tasks import Prompt


@dataclass
class Recovery:
    pending: list[Prompt] = field(default_factory=list)  # to issue again, oldest first
    newest_published: int = -1
    starts: int = 0  # how many times this run started before (names fresh prompt ids apart)
    trained_rolled_back: int = 0  # groups trained by updates after the checkpoint (to redo)

    def note(self, updates: int, steps: int, checkpoint: Path | None) -> str:
        """What the operator reads when a run resumes: the updates the checkpoint holds, which is
        what the run counts (not the version, which skips the numbers a crash lost)."""
        return (f"resumed after update {updates} of {steps} (checkpoint {checkpoint.name if checkpoint else 'none'}): "
                f"{len(self.pending)} prompts in flight or rolled back re-issued"
                + (f", versions continue after v{self.newest_published}" if self.newest_published >= 0 else ""))


class Ledger:
    def __init__(self, path: Path):
        self.path = path
        torn = False
        if path.exists() and path.stat().st_size > 0:
            with path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # Prompts written as leased and not trained yet: a prompt released and leased again is
        # not written again (16 identities leasing and releasing wrote 120 KB/s of repeats).
        self._open: set[str] = set()
        if torn:  # a kill cut the last line short: end it, so the next event is a line of its own
            os.write(self._fd, b"\n")

    def _write(self, event: dict) -> None:
        os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())

    def leased(self, prompts: list[Prompt]) -> None:
        new = [p for p in prompts if p.id not in self._open]
        if new:  # replay keeps a prompt's first lease line: a repeat says nothing more
            self._open.update(p.id for p in new)
            self._write({"e": "L", "p": [[p.id, p.text, p.answer, p.seed] for p in new]})

    def trained(self, step: int, prompt_ids: list[str]) -> None:
        self._open.difference_update(prompt_ids)
        self._write({"e": "T", "s": step, "p": prompt_ids})

    def published(self, version: int) -> None:
        self._write({"e": "P", "v": version})

    def resumed(self, step: int) -> None:
        self._write({"e": "R", "from": step})

    def close(self) -> None:
        os.close(self._fd)

    @classmethod
    def open_run(cls, path: Path, version: int, resumed: bool) -> tuple["Ledger", Recovery]:
        """The run's ledger, and what a resumed run (at update `version`) owes: replayed, then marked resumed."""
        recovery = cls.replay(path, version) if resumed else Recovery()
        ledger = cls(path)
        if resumed:
            ledger.resumed(version)
        return ledger, recovery

    @staticmethod
    def replay(path: Path, checkpoint_step: int) -> Recovery:
        """What a learner resuming from the checkpoint of `checkpoint_step` owes the run."""
        out = Recovery()
        if not path.exists():
            return out
        # A training no later resume rolls back, by an update this one keeps, is final: its prompt
        # is dropped as it is read. Held to the end, a week's ledger (every prompt ever leased) was
        # what a resume had to fit in memory. The resumes' checkpoints are read first to tell.
        froms = [ev["from"] for ev in _events(path, only='"R"') if ev.get("e") == "R"]
        keeps = [checkpoint_step] * (len(froms) + 1)  # per resumes seen: the oldest update still kept
        for i in range(len(froms) - 1, -1, -1):
            keeps[i] = min(keeps[i + 1], froms[i])
        leased: dict[str, Prompt] = {}  # insertion order = first issue
        trained: dict[str, int] = {}  # trainings a later resume may still roll back
        for ev in _events(path):
            kind = ev.get("e")
            if kind == "L":
                for pid, text, answer, *seed in ev["p"]:  # ledgers before episodes had no seed
                    leased.setdefault(pid, Prompt(pid, text, answer, *seed))
            elif kind == "T":
                final = ev["s"] <= keeps[out.starts]
                for pid in ev["p"]:
                    if final:
                        leased.pop(pid, None)
                        trained.pop(pid, None)
                    else:
                        trained[pid] = ev["s"]
            elif kind == "P":
                out.newest_published = max(out.newest_published, ev["v"])
            elif kind == "R":  # that resume rolled back every update after its checkpoint
                out.starts += 1
                trained = {pid: step for pid, step in trained.items() if step <= ev["from"]}
        for pid, prompt in leased.items():
            step = trained.get(pid)
            if step is None or step > checkpoint_step:
                out.pending.append(prompt)
                out.trained_rolled_back += step is not None
        out.starts += 1  # the first start wrote no "R"
        return out


def _events(path: Path, only: str | None = None) -> Iterator[dict]:
    """The ledger's events (lines containing `only`, if given), the line a kill cut short skipped."""
    with path.open() as f:
        for line in f:
            if only is not None and only not in line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def unique_ids(prompts: Iterator[Prompt], start: int = 0) -> Iterator[Prompt]:
    """A task may repeat a prompt (epochs over a file); each issue gets its own id in this run
    (and in each of its starts, so a resumed run's ids never meet those it re-issues)."""
    prefix = f"r{start}." if start else ""
    for i, p in enumerate(prompts):
        yield dataclasses.replace(p, id=f"{prefix}{i}:{p.id}")  # the seed (the episode's start) kept
