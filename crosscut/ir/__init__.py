"""The intermediate representations every layer above reads, and nothing else.

Plain data with ``lint()``/``validate()`` and JSON forms, no algorithms that
choose anything: the traced graph (:mod:`~crosscut.ir.graph`), the solver's
input (:mod:`~crosscut.ir.problem`, no torch), the plan and its JSON schema
(:mod:`~crosscut.ir.plan`, ``plan_schema.json``) and schedules as actions
(:mod:`~crosscut.ir.schedule`). Kept at the bottom so the front end, the cost
models, the partitioner, codegen, both runtimes and the drawings can all read
them without reaching up. Nothing here imports torch, so the visualizer and
the solvers stay torch-free.
"""
