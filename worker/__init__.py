"""ipuserve.worker."""
