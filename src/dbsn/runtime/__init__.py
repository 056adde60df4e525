"""The runtime: everything that starts, places, resumes and checks runs, above methods, nets and data.

- `run`: the bodies of `train.py` and `evaluate.py` (build, fit, test, report);
- `folder`: a run folder holds one run (the claim, its lock, run.json, Hydra's files after the claim);
- `sweep`: every job of a sweep composed and checked before the first starts;
- `config`: checks of a composed config (unknown keys, wrong types, launcher mismatches), with
  `config_errors`, `origin` (where a refused value came from), `trainer_settings` and `preflight`
  (what can be checked before the network is built, and `check_job` for sweeps);
- `resume`: a resume changes no setting of the run unless `resume_changes` lists it, and then applies it;
- `evaluation`, `evaluation_folder`: evaluate's building blocks, and which folders it may write;
- `disk`: `OutputError`, a run's files that cannot be written (a full or read-only disk);
- `checkpoint`: atomic checkpoints, the run config and random state inside them, clear errors;
- `integrity`: the digest every checkpoint carries and the checks before one is used;
- `signals`: SIGTERM, SIGINT, SIGHUP stop a run as `RunInterrupted` (exit 128 + signum);
- `ddp`, `child`, `rank`: single-node DDP whose extra ranks start from the run's saved config
  (each runs `python -m dbsn.runtime.child`), and which rank this process is;
- `cluster`: SLURM jobs (requeue, the job's facts, resume from the run folder);
- `group`, `turns`: several runs in one process, each equal to its solo run (off by default);
- `progress`: progress lines for logs without a terminal.

The names of a run folder's files live below, in `dbsn.evaluation.runs` (the report reads them too).
"""
