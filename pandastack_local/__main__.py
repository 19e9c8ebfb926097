"""``python -m pandastack_local serve ...``."""

from .cli import main

if __name__ == "__main__":
    main()
