"""The interactive console on a running cluster: ``python -m schedulers.console --connect tcp://HOST:PORT``.

Commands (``help`` lists them): ``nodes``, ``jobs``, ``status [JOB] [--actions]``,
``schedule [JOB]``, ``submit CONFIG.json``, ``run JOB N``, ``wait JOB``, ``pause JOB``,
``resume JOB``, ``stop JOB``, ``set JOB KEY VALUE``, ``checkpoint JOB DIR``,
``trace JOB FILE``, ``plot JOB FILE.png``, ``close JOB``, ``quit``.
"""
