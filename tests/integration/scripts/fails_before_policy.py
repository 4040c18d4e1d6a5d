import json  # noqa: F401  (a real script imports before it fails)

raise RuntimeError("cannot open the data set")
