"""ipuserve.client."""
