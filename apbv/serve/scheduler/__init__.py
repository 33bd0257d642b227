"""Scheduling: admission and deadlines (:mod:`~apbv.serve.scheduler.admission`), the
memory budget (:mod:`~apbv.serve.scheduler.memory_budget`), the fair order of jobs
(:mod:`~apbv.serve.scheduler.fair_order`) and each replica's queue and worker
(:mod:`~apbv.serve.scheduler.replicas`)."""
