"""The runtime: everything that starts, places, resumes and checks runs, above methods, nets and data.

- `run`: the bodies of `train.py` and `evaluate.py` (build, fit, test, report);
- `config`: checks of a composed config (unknown keys, wrong types, launcher mismatches);
- `checkpoint`: atomic checkpoints, the run config and random state inside them, clear errors;
- `ddp`, `rank`: single-node DDP whose extra ranks start from the run's saved config;
- `cluster`: SLURM jobs (requeue, the job's facts, resume from the run folder);
- `progress`: progress lines for logs without a terminal;
- `layout`: the names of the files in a run folder.
"""
