"""The torchrun wing: a rank per stage (per device of a cross-shaped stage's group).

:class:`~crosscut.runtime.dist.rank_executor.DistributedPipeline` runs its
schedule row through the shared :class:`~crosscut.runtime.engine.StageEngine`
over P2P messages (:mod:`~crosscut.runtime.dist.p2p`,
:mod:`~crosscut.runtime.dist.stage_io`); the rank layout and start-up checks
(:mod:`~crosscut.runtime.dist.world`, :mod:`~crosscut.runtime.dist.plan_rules`),
device groups on ranks (``group_members``, ``group_role``, ``group_comm``),
the replicas' all-reduce (``overlap``), step batch norm on ranks
(``bn_commit``), wire dtypes under autocast, the grad scaler and per-rank
state files. Nothing here imports the ``local`` wing.
"""
