"""Stage 2, the plan: the data model (model.py) and what is done to it before any byte moves:
checks (every element once, the model's shapes), normalisation (names, ties, dtypes) and the
layout of output files and offsets. Metadata only: the checks that read bytes are checks/."""
