"""The one way to change a record read from a projection: read it with its revision, let a
mutator decide, commit with a compare, and on a lost compare wait for the winning write and
decide again (bounded).

May not decide anything itself: the mutators are the callers'.
"""
