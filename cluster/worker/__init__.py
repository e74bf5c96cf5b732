"""The worker side: the asynchronous agent and its synchronous session."""
