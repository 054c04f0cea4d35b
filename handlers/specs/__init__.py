"""What API input may be, and what a stored spec says: bounds and checks of ids, labels and
specs (``InvalidSpec`` naming the field), the ApplyWorkload request -> stored record conversion,
facts read off a stored spec, the VM spec JSON, and the agent apply request.

Pure: no I/O; every package that takes input checks it here.
"""
