"""The partitioner: the problem built from a graph and costs, the solvers, evaluation, simulation.

Tracing is not here: it is the front end's (:mod:`crosscut.frontend`). This
package reads an :class:`~crosscut.ir.graph.OpGraph` and a cost table, and
writes a :class:`~crosscut.ir.plan.Plan`; nothing in it runs the model.
"""
