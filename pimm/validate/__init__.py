"""Checks that a config scales before a long job: `pimm validate-scaling` (pimm.validate.scaling)
runs real launches (pimm.validate.runs) and writes a report (pimm.validate.report)."""
