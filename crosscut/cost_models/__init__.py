"""Cost models: devices and clusters, analytic and profiled per-node costs, memory, links.

The partitioner reads a :class:`~crosscut.cost_models.table.CostTable`
(seconds per node per device kind, bytes per node) and a
:class:`~crosscut.cost_models.cluster.Cluster` (devices, caps, links); this
package makes both, and knows nothing about solvers.

The package re-exports nothing: import each name from its module
(``crosscut.cost_models.cluster.Cluster``; the public ``crosscut.Cluster`` is
the same class). The simulator and the drawings read the torch-free modules
(device presets, calibration) without loading torch, which the cluster,
analytic and profiled costs need; a package that imported its names would
load torch for them all.
"""
