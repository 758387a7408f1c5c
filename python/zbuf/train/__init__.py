"""The machinery behind the ``zbuf`` command (one concern per module).

- ``config``: ``TrainConfig`` and ``Engine``, every option typed and validated; ``options``:
  the command-line side of its fields (one definition per option); ``errors``: ``ConfigError``.
- ``simulate``: one process as rank 0 of N (``--simulate-world``), the communication estimate;
  ``fit``: ``zbuf fit``, the largest micro-batch that fits a card, by simulated probes.
- ``data``: synthetic learnable tasks, identical on every engine and world size.
- ``engines``: ddp / fsdp2 / zbuf-eager / zbuf applied to the same initial model.
- ``loop``: one rank's timed training run of one engine (``StepRow``: one step's numbers).
- ``save_resume``: when a run saves checkpoints and resumes from them (``SaveResumePolicy``).
- ``metrics``: fair device memory, allocator retries, MFU, versions.
- ``launcher``: torchrun-compatible worker processes that never outlive the launcher.
- ``worker``: a rank's entry point; ``runner``: train / bench orchestration; ``interrupted``:
  the record of a stopped run, every rank's steps joined; ``refusals``: the one line for input
  the ranks refuse (a damaged checkpoint, a plan that does not fit); ``resume_commands``: the
  command lines that resume a run.
- ``record``: the JSON record and the markdown table; ``progress``: live bar and tables;
  ``report``: plots.
"""
