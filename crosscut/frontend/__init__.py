"""The fx front end: a model in, an :class:`~crosscut.ir.graph.OpGraph` out.

Everything that reads a PyTorch module's forward lives here, below the cost
models and the partitioner: tracing (:mod:`~crosscut.frontend.tracer`), shape
and FLOP propagation on fake tensors (:mod:`~crosscut.frontend.propagate`),
alias analysis and mutation ties (:mod:`~crosscut.frontend.alias`),
``torch.no_grad()`` blocks (:mod:`~crosscut.frontend.grad_mode`) and the
refusal of Python state a forward changes (:mod:`~crosscut.frontend.python_state`).
The tracing module is ``tracer``, not ``trace``, so the package's ``trace`` is
the function and never a module that shadows it.
"""

from crosscut.frontend.tracer import trace

__all__ = ["trace"]
