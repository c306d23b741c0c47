"""What the tests share that is not a fixture: checkpoint writers, servers, processes, paths."""
