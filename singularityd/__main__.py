"""Entry point: `python -m singularityd` / `singularityd`."""

from singularityd.daemon import main

if __name__ == "__main__":
    main()
