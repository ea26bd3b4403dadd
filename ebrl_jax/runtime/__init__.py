"""What every process of a run uses, whatever its role, and importing no role: start-up (`startup`), errors and
their messages across processes (`errors`), lifecycle (`lifecycle`: stop signals, version waits, start-up phases),
worker feedback (`feedback`), storage (`storage`), the timeline (`tracing`) and run metrics (`metrics`)."""
