"""`sing`: the command-line client of singularityd (never imports textual)."""
