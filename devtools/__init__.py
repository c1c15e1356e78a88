"""Development helpers shared by tests/, bench/ and hack/: reach a cluster (start the local one,
run kubectl, make namespaces), wait for a condition, read the examples. Not shipped: nothing in
operator/ or trainer/ imports this package; scripts put the repository root on sys.path."""
