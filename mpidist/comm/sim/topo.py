"""Topologies: Cartesian, graph and distributed-graph communicators and the neighbor lists they define."""

import itertools
import operator

from mpi4py import MPI

from .errors import mpi_error

__all__ = ["Cart", "Graph", "DistGraph", "class_for", "cart_layout", "graph_layout"]


class Cart:
    kind = MPI.CART

    def __init__(self, dims, periods):
        self.dims, self.periods = list(dims), list(periods)
        self.size = 1
        for d in self.dims:
            self.size *= d

    def coords(self, rank):
        out = []
        for d in reversed(self.dims):
            out.append(rank % d)
            rank //= d
        return out[::-1]

    def rank_of(self, coords):
        rank = 0
        for c, d, p in zip(coords, self.dims, self.periods):
            if not 0 <= c < d:
                if not p:
                    return MPI.PROC_NULL
                c %= d
            rank = rank * d + c
        return rank

    def shift(self, rank, direction, disp):
        c = self.coords(rank)
        lo, hi = list(c), list(c)
        lo[direction] -= disp
        hi[direction] += disp
        return self.rank_of(lo), self.rank_of(hi)

    def neighbors(self, rank):
        out = []
        for d in range(len(self.dims)):
            out.extend(self.shift(rank, d, 1))
        return out, list(out)


class Graph:
    kind = MPI.GRAPH

    def __init__(self, index, edges):
        self.index, self.edges = list(index), list(edges)
        self.size = len(self.index)

    def adjacent(self, rank):
        lo = self.index[rank - 1] if rank else 0
        return self.edges[lo: self.index[rank]]

    def neighbors(self, rank):
        adj = self.adjacent(rank)
        return list(adj), list(adj)


class DistGraph:
    kind = MPI.DIST_GRAPH

    def __init__(self, layouts):
        self.layouts = layouts   # per rank: (sources, sourceweights, destinations, destweights, weighted)
        self.size = len(layouts)

    def neighbors(self, rank):
        s, _, d, _, _ = self.layouts[rank]
        return list(s), list(d)


def cart_layout(size, dims, periods):
    dims = [operator.index(d) for d in dims]  # mpi4py reads int arrays with __index__: a float is refused
    if periods is None or isinstance(periods, (bool, int)):  # one value for every dimension, as in mpi4py
        periods = [bool(periods)] * len(dims)
    periods = [bool(p) for p in periods]
    if len(periods) != len(dims):
        raise ValueError(f"Create_cart: {len(periods)} periods for {len(dims)} dimensions")
    layout = Cart(dims, periods)
    if layout.size > size:
        raise mpi_error(MPI.ERR_DIMS, f"Create_cart: dims {dims} need {layout.size} ranks, the communicator has {size}")
    return layout


def graph_index(index, edges):
    """``index`` as MPI takes it; mpi4py also takes the standard adjacency form with a leading 0."""
    index, edges = [operator.index(i) for i in index], [operator.index(e) for e in edges]
    if index and index[0] == 0 and index[-1] == len(edges):
        index = index[1:]
    return index, edges


def graph_layout(size, index, edges):
    layout = Graph(*graph_index(index, edges))
    if layout.size > size:
        raise mpi_error(MPI.ERR_ARG, f"Create_graph: {layout.size} nodes, the communicator has {size} ranks")
    return layout


def _adjacent_weights(weights, count, what):
    """Weights as a list (None: unweighted); MPI.WEIGHTS_EMPTY only for no edges, as mpi4py checks."""
    if weights is None or weights is MPI.UNWEIGHTED:
        return None
    if weights is MPI.WEIGHTS_EMPTY:
        if count:
            raise ValueError(f"Create_dist_graph_adjacent: MPI.WEIGHTS_EMPTY given for {count} {what}")
        return []
    weights = [int(w) for w in weights]
    if len(weights) != count:
        raise ValueError(f"Create_dist_graph_adjacent: {len(weights)} weights for {count} {what}")
    return weights


def dist_graph_adjacent(sources, destinations, sourceweights=None, destweights=None):
    sources = [] if sources is None else [int(r) for r in sources]
    destinations = [] if destinations is None else [int(r) for r in destinations]
    sw = _adjacent_weights(sourceweights, len(sources), "sources")
    dw = _adjacent_weights(destweights, len(destinations), "destinations")
    return ("adjacent", sources, sw, destinations, dw, sw is not None or dw is not None)


def dist_graph_edges(sources, degrees, destinations, weights=None):
    weighted = weights is not None and weights is not MPI.UNWEIGHTED
    w = list(weights) if weighted and weights is not MPI.WEIGHTS_EMPTY else None
    edges, k = [], 0
    for s, deg in zip(sources, degrees):
        for _ in range(deg):
            edges.append((s, destinations[k], w[k] if w else 1))
            k += 1
    return ("edges", edges, weighted)


def merge_dist_graph(parts):
    n = len(parts)
    if all(p[0] == "adjacent" for p in parts):
        return [(p[1], p[2], p[3], p[4], p[5]) for p in parts]
    srcs = [[] for _ in range(n)]
    dsts = [[] for _ in range(n)]
    weighted = any(p[-1] for p in parts)
    for p in parts:
        for s, d, w in p[1]:
            dsts[s].append((d, w))
            srcs[d].append((s, w))
    return [([s for s, _ in srcs[r]], [w for _, w in srcs[r]] if weighted else None,
             [d for d, _ in dsts[r]], [w for _, w in dsts[r]] if weighted else None, weighted) for r in range(n)]


def class_for(topo):
    from .comm import SimComm

    if isinstance(topo, Cart):
        return SimCartcomm
    if isinstance(topo, Graph):
        return SimGraphcomm
    if isinstance(topo, DistGraph):
        return SimDistgraphcomm
    return SimComm


def _make_classes():
    from .comm import SimComm

    class SimTopocomm(SimComm):
        _TOPOLOGY = staticmethod(lambda topo: topo is not None)
        @property
        def degrees(self):
            s, d = self._ctx.topo.neighbors(self._rank)
            return len(s), len(d)

        @property
        def indegree(self):
            return self.degrees[0]

        @property
        def outdegree(self):
            return self.degrees[1]

        @property
        def inoutedges(self):
            return tuple(map(list, self._ctx.topo.neighbors(self._rank)))

        @property
        def inedges(self):
            return self.inoutedges[0]

        @property
        def outedges(self):
            return self.inoutedges[1]

    class SimCartcomm(SimTopocomm):
        _TOPOLOGY = staticmethod(lambda topo: isinstance(topo, Cart))
        def Get_dim(self):
            return len(self._live("Get_dim").topo.dims)

        ndim = dim = property(Get_dim)

        def Get_topo(self):
            t = self._live("Get_topo").topo
            return list(t.dims), [int(p) for p in t.periods], t.coords(self._rank)

        topo = property(Get_topo)
        dims = property(lambda self: self.Get_topo()[0])
        periods = property(lambda self: self.Get_topo()[1])
        coords = property(lambda self: self.Get_topo()[2])

        def Get_cart_rank(self, coords):
            return self._live("Get_cart_rank").topo.rank_of(list(coords))

        def Get_coords(self, rank):
            return self._live("Get_coords").topo.coords(rank)

        def Shift(self, direction, disp):
            return self._live("Shift").topo.shift(self._rank, direction, disp)

        def Sub(self, remain_dims):
            t = self._live("Sub").topo
            coords = t.coords(self._rank)
            keep = [bool(k) for k in remain_dims]
            color = tuple(c for c, k in zip(coords, keep) if not k)
            color_id = 0
            for c, d, k in zip(coords, t.dims, keep):
                if not k:
                    color_id = color_id * d + c
            del color
            sub = Cart([d for d, k in zip(t.dims, keep) if k], [p for p, k in zip(t.periods, keep) if k])
            return self._derive("Sub", color_id, self._rank, topo=sub)

    class SimGraphcomm(SimTopocomm):
        _TOPOLOGY = staticmethod(lambda topo: isinstance(topo, Graph))
        def Get_dims(self):
            t = self._live("Get_dims").topo
            return t.size, len(t.edges)

        dims = property(Get_dims)
        nnodes = property(lambda self: self.Get_dims()[0])
        nedges = property(lambda self: self.Get_dims()[1])

        def Get_topo(self):
            t = self._live("Get_topo").topo
            return list(t.index), list(t.edges)

        topo = property(Get_topo)
        index = property(lambda self: self.Get_topo()[0])
        edges = property(lambda self: self.Get_topo()[1])

        def Get_neighbors_count(self, rank):
            return len(self._live("Get_neighbors_count").topo.adjacent(rank))

        def Get_neighbors(self, rank):
            return list(self._live("Get_neighbors").topo.adjacent(rank))

        nneighbors = property(lambda self: self.Get_neighbors_count(self._rank))
        neighbors = property(lambda self: self.Get_neighbors(self._rank))

    class SimDistgraphcomm(SimTopocomm):
        _TOPOLOGY = staticmethod(lambda topo: isinstance(topo, DistGraph))
        def Get_dist_neighbors_count(self):
            s, _, d, _, weighted = self._live("Get_dist_neighbors_count").topo.layouts[self._rank]
            return len(s), len(d), bool(weighted)

        def Get_dist_neighbors(self):
            s, sw, d, dw, weighted = self._live("Get_dist_neighbors").topo.layouts[self._rank]
            return list(s), list(d), ((sw or [], dw or []) if weighted else None)

    return SimTopocomm, SimCartcomm, SimGraphcomm, SimDistgraphcomm


SimTopocomm, SimCartcomm, SimGraphcomm, SimDistgraphcomm = (None,) * 4


def _init():
    global SimTopocomm, SimCartcomm, SimGraphcomm, SimDistgraphcomm
    SimTopocomm, SimCartcomm, SimGraphcomm, SimDistgraphcomm = _make_classes()
    return itertools  # keep the import used
