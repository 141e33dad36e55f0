"""The P:D planner: measure workers (`pdserve profile`), model a cluster of them, recommend how many of each
role a workload needs (`pdserve plan`). No torch: it runs beside any worker, real or simulated."""
