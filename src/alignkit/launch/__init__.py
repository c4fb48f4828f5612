"""``alignkit launch``: one module per way of starting ``alignkit train`` on several processes.

* ``args.py``: the checks every path shares (launcher name, process counts) and ``LaunchError``;
* ``torchrun.py``: the launcher command on one node (torchrun, the deepspeed launcher, accelerate);
* ``run.py``: runs that command and stands by it (one line for a worker's error, the workers go when it goes);
* ``parent_death.py``: the parent-death signal that takes the launcher's processes with it;
* ``deepspeed_runner.py``: DeepSpeed's runner with its ``launch`` child armed with that signal too;
* ``slurm.py`` (with ``slurm_train.sbatch.j2``): srun over a Slurm allocation, or the sbatch script;
* ``k8s.py``: a Kubeflow PyTorchJob manifest.

Nothing here imports torch at module level: ``alignkit --help`` and a worker's start-up stay light.
"""
