"""The house itself: import graph, class state, hygiene, README and suite layout."""
