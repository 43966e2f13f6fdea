"""``python -m lightning_memkit.cli``: the ``memkit`` command."""

from lightning_memkit.cli.main import main

if __name__ == "__main__":
    main()
