"""``python -m advisor.cli``: the same as the ``mpadvise`` command."""

from advisor.cli import main

main()
