"""``python -m advisor.cli``: the same as the ``mpadvise`` command."""

from advisor.cli._app import main

main()
