"""The rank groups: the typed operations that cross Ray (:mod:`~apbv.serve.ranks.ops`), the
rank actors and their group (:mod:`~apbv.serve.ranks.group`), where ranks and streams go
(:mod:`~apbv.serve.ranks.placement`) and the Ray cluster (:mod:`~apbv.serve.ranks.ray_cluster`)."""
