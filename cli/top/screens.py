"""The modal screens of `sing top`: a choice (a peer, a number of devices), the confirmation before
an action, and the help."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from singularity.cli.source import ACTIONS
from singularity.cli.top.view import STATE_STYLES


class ConfirmScreen(ModalScreen[bool]):
    """Asks once before acting on a job; dismissed with True (y, Enter on Yes) or False."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, detail: str) -> None:
        super().__init__()
        self.question = question
        self.detail = detail

    def compose(self) -> ComposeResult:
        """The question, what it will do, and two buttons."""
        with Vertical(id="dialog"):
            yield Static(Text(self.question, style="bold"), id="question")
            yield Static(self.detail, id="explanation")
            with Horizontal(id="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        """No is focused, so Enter alone does nothing irreversible."""
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """A click (or Enter) on a button answers."""
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        """A key answers."""
        self.dismiss(answer)


class ChoiceScreen(ModalScreen[str | None]):
    """Asks for one of a few choices (the peer to move a job to, its new number of devices);
    dismissed with the chosen value, or None (Escape)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, choices: list[tuple[str, str]]) -> None:
        super().__init__()
        self.question = question
        self.choices = choices

    def compose(self) -> ComposeResult:
        """The question and one numbered button per choice (value, label), then Cancel."""
        with Vertical(id="dialog"):
            yield Static(Text(self.question, style="bold"), id="question")
            with Vertical(id="choices"):
                for number, (value, label) in enumerate(self.choices, start=1):
                    yield Button(f"{number}. {label}", id=f"choice-{number}", name=value)
            with Horizontal(id="buttons"):
                yield Button("Cancel (Esc)", variant="primary", id="cancel")

    def on_mount(self) -> None:
        """Cancel is focused, so Enter alone does nothing."""
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """A click (or Enter) on a choice takes it; on Cancel, nothing."""
        self.dismiss(event.button.name if event.button.id != "cancel" else None)

    def on_key(self, event: Any) -> None:
        """A digit takes the choice of that number."""
        if event.character and event.character.isdigit() and 1 <= int(event.character) <= len(self.choices):
            event.stop()
            self.dismiss(self.choices[int(event.character) - 1][0])

    def action_cancel(self) -> None:
        """Escape: no choice."""
        self.dismiss(None)


def help_text() -> Text:
    """Every key of `sing top`, the actions and the state colours."""
    text = Text("sing top\n\n", style="bold")
    keys = [
        ("↑ ↓, mouse", "choose a job (its detail and log follow below)"),
        ("click a header, o / O", "sort by a column / reverse the order"),
        ("/", "filter jobs by words (Enter keeps, Escape clears)"),
        ("a", "show ended jobs too, or only live ones"),
        ("tab", "move between the panes; 1-4 pick a detail tab"),
        ("?", "this help (Escape closes)"),
        ("q", "quit"),
    ]
    keys += [(action.key, f"{action.name}: {action.unavailable or action.explanation}") for action in ACTIONS]
    for key, meaning in keys:
        text.append(f"  {key:<24}", style="bold cyan")
        text.append(meaning + "\n")
    text.append("\nActions ask for confirmation first.\nStates: ")
    for state, style in STATE_STYLES.items():
        text.append(state, style=style)
        text.append(" ")
    text.append("\nPriority: ")
    text.append("above 0", style="bold yellow")
    text.append(", 0, ")
    text.append("below 0", style="dim")
    return text


class HelpScreen(ModalScreen[None]):
    """The keys and colours of `sing top`."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,question_mark,q", "close", "Close")]

    def compose(self) -> ComposeResult:
        """One panel of text."""
        with Vertical(id="help"):
            yield Static(help_text())

    def action_close(self) -> None:
        """Back to the overview."""
        self.dismiss(None)
