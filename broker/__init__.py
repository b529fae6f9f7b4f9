"""ipuserve.broker."""
