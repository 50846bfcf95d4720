"""The local wing: every stage in this process, a thread per device.

:class:`~crosscut.runtime.local.compiled.CompiledModule` (the module
``crosscut.compile`` returns outside torchrun) runs its schedule through
:class:`~crosscut.runtime.local.thread_executor.LocalExecutor`, which drives
the shared :class:`~crosscut.runtime.engine.StageEngine` over an in-process
value table; :mod:`~crosscut.runtime.local.model_keys` keeps its state under
the model's own keys. Nothing here imports the ``dist`` wing.
"""
