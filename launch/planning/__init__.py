"""Will a job fit, and how fast will it run: the library half of `launch.plan` and
`launch.rehearse`.

    report.py        the planner's tables
    memory_check.py  the check every run makes before any collective
    rehearsal.py     one rank of a real job run in one process against a fake world
"""
