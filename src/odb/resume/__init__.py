"""Resume: the loader's ``state_dict`` assembled, versioned and validated.

``state`` (the saved format, its cursor and its checks), ``elastic`` (re-partition of an
epoch's remaining samples across a new world size), ``loader_state`` (what the loader
saves and loads).
"""
