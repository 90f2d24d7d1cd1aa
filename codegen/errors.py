"""Why codegen could not compile a graph. The backend catches UnsupportedError and runs the segment on the CPU."""

from __future__ import annotations


class UnsupportedError(NotImplementedError):
    """The CTPU back end cannot compile this graph: an op, a layout, or a resource limit (see subclasses)."""


class CapacityError(UnsupportedError):
    """The graph does not fit the configuration: vmem, imem or registers."""


class ProgramTooLargeError(CapacityError):
    """The graph's program has more bundles than imem holds. Smaller graphs may fit: the backend splits the
    graph into several programs, launched one after the other (`splittable`)."""

    splittable = True
