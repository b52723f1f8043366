"""DeepSpeed compatibility: a ``ds_config.json`` as it is, read into a job spec.

:mod:`~schedulers.deepspeed.config` reads the file (and the job file beside it);
:mod:`~schedulers.deepspeed.keys` and :mod:`~schedulers.deepspeed.optimizer` are the
tables of DeepSpeed's keys; :mod:`~schedulers.deepspeed.spec_keys` reads actorpipe's own
(the spec's sections and fields); :mod:`~schedulers.deepspeed.checks` the checks of single values.
"""
