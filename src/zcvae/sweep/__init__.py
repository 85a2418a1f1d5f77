"""Run families: the family file (:mod:`~zcvae.sweep.family`), a run's command line
(:mod:`~zcvae.sweep.flags`), SLURM scripts (:mod:`~zcvae.sweep.slurm`, template ``slurm.sbatch`` shipped as
package data) and the local runner (:mod:`~zcvae.sweep.local`). The CLI is ``zcvae sweep``
(``zcvae.commands.sweep``)."""
