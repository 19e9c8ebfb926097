"""``python -m pandastack_local serve ...``."""

from pandastack_local.cli import main

if __name__ == "__main__":
    main()
