"""The package version, in a module of its own.

Read by the root package (``crosscut.__version__``), by the plan builder (every
plan records the version that made it) and by ``crosscut --version``; a module
at the bottom of the layers, so the partitioner need not import the root
package, which sits at the top.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
