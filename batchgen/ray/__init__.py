"""batchgen on Ray: `batchgen run JOB --ray` (driver.py: units dealt to worker actors as they free up, exactly
once through the commit protocol) and `build_processor` (processor.py: a Ray Data stage that generates a
Dataset's rows with batchgen engines, without resume). Ray itself is imported only when one of them runs."""


def build_processor(*args, **kwargs):
    """See batchgen.ray.processor.build_processor."""
    from batchgen.ray.processor import build_processor as build

    return build(*args, **kwargs)
