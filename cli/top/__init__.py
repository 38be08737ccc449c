"""`sing top`, the terminal view of singularityd; the only part of `sing` that imports textual."""
