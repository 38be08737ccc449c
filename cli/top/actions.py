"""The job actions of `sing top` (stop, preempt, migrate, resize, ...): choose, confirm, run in a worker."""

from __future__ import annotations

import threading
from functools import partial

from textual.app import App

from singularity.cli.errors import CliError
from singularity.cli.source import ACTIONS, DataSource
from singularity.cli.top import view
from singularity.cli.top.messages import ActionDone
from singularity.cli.top.screens import ChoiceScreen, ConfirmScreen
from singularityd.api.v1 import singularity_pb2 as pb

ACTION_BY_NAME = {action.name: action for action in ACTIONS}


class JobActions(App[None]):
    """The part of the app that acts on the chosen job and tells the user what came of it."""

    source: DataSource
    jobs: dict[int, pb.Job]
    peers: pb.ListPeersResponse
    selected: int | None
    notices: list[str]
    _wake: threading.Event

    def _record(self, text: str) -> None:
        """Keep what the app told the user (tests read it)."""
        self.notices.append(text)

    def _announce(self, text: str, severity: str = "information") -> None:
        """Tell the user something in a toast, and keep it."""
        self._record(text)
        self.notify(text, severity="error" if severity == "error" else "information", timeout=8)

    def action_job(self, name: str) -> None:
        """Act on the chosen job, after a confirmation."""
        action = ACTION_BY_NAME[name]
        job = self.jobs.get(self.selected) if self.selected is not None else None
        if job is None:
            self._announce("choose a job first", "error")
            return
        if action.unavailable:
            self._announce(f"{name}: {action.unavailable}", "error")
            return
        if name == "migrate":
            self._choose_peer(job)
            return
        if name == "resize":
            self._choose_size(job)
            return
        self._confirm(name, job)

    def _confirm(self, name: str, job: pb.Job, target: str = "") -> None:
        """Ask once, then run the action (migrate: to the target peer) in a worker."""
        action = ACTION_BY_NAME[name]
        where = f" to {target}" if target else ""
        if name == "resize":
            where += " device" if target == "1" else " devices"
        question = f"{name.capitalize()} job {job.id} ({job.name}, {job.state}){where}?"
        detail = f"This will {action.explanation}."

        def answered(yes: bool | None) -> None:
            """Run the action once the user said yes."""
            if yes:
                self._announce(f"{name}: job {job.id}{where}…")
                work = partial(self._run_action, name, job.id, target)
                self.run_worker(work, thread=True, group="actions", exit_on_error=False)

        self.push_screen(ConfirmScreen(question, detail), callback=answered)

    def _choose_peer(self, job: pb.Job) -> None:
        """Ask which peer to move the job to (those alive with room for it), then confirm."""
        if not self.peers.node:
            self._announce("migrate: this daemon is in no cluster (sing cluster init / join)", "error")
            return
        targets = view.migration_targets(self.peers, job.gpus)
        if not targets:
            self._announce(f"migrate: no peer is alive with {job.gpus} free device(s)", "error")
            return
        choices = [(p.node, f"{p.node}: {p.free}/{p.devices} devices free, {p.address}") for p in targets]

        def chosen(peer: str | None) -> None:
            """Confirm the move to the chosen peer."""
            if peer:
                self._confirm("migrate", job, peer)

        self.push_screen(ChoiceScreen(f"Move job {job.id} ({job.name}) to which peer?", choices), chosen)

    def _choose_size(self, job: pb.Job) -> None:
        """Ask how many devices a running job of several ranks should have, then confirm."""
        refusal = view.resize_refusal(job)
        if refusal:
            self._announce(f"resize: {refusal}", "error")
            return
        sizes = [n for n in range(1, job.ranks + 1) if n != job.gpus]
        choices = [(str(n), f"{n} device{'s' if n != 1 else ''}") for n in sizes]

        def chosen(size: str | None) -> None:
            """Confirm the resize to the chosen size."""
            if size:
                self._confirm("resize", job, size)

        question = f"Resize job {job.id} ({job.name}, {job.ranks} ranks on {job.gpus}) to how many devices?"
        self.push_screen(ChoiceScreen(question, choices), chosen)

    def _run_action(self, name: str, job_id: int, target: str = "") -> None:
        """Thread: do an action on a job, post what came of it and wake the refresh."""
        try:
            self.post_message(ActionDone(self.source.act(name, job_id, target), True))
        except CliError as error:
            self.post_message(ActionDone(f"{name} job {job_id}: {error.message}", False))
        self._wake.set()
