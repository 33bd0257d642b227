"""Standing questions, pure: the event rule (:mod:`~apbv.watch.rules`), shared by the
server's watches and ``apbv watch --watch``."""
