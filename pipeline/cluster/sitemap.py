"""The dashboard's ``/sitemap.json``, mended: distributed's listed the files behind static
routes and raised on those that name none, as the dashboard's do, printing a traceback into
the run's output at any local user's request. ``install_sitemap`` serves ours instead."""

from __future__ import annotations

import distributed.http.routing
from tornado.routing import PathMatches, RuleRouter


def _paths(router: RuleRouter, seen: set, out: set[str]) -> None:
    """The path patterns of ``router``'s rules and of the routers below it."""
    if router in seen:
        return
    seen.add(router)
    for rule in [*router.named_rules.values(), *router.rules]:
        if isinstance(rule.matcher, PathMatches):
            out.add(rule.matcher.regex.pattern.rstrip("$"))
        if isinstance(rule.target, RuleRouter):
            _paths(rule.target, seen, out)


class Sitemap(distributed.http.routing.DirectoryHandler):
    """``/sitemap.json``: every route's path pattern (distributed's own listed the files
    behind static routes and raised on those that name none, as the dashboard's do)."""

    def get(self) -> None:
        out: set[str] = set()
        seen: set = set()
        for app in [*self.application.applications, self.application]:
            if hasattr(app, "app_paths"):  # bokeh's application
                out.update(app.app_paths)
            else:
                _paths(app.default_router, seen, out)
                _paths(app.wildcard_router, seen, out)
        self.write({"paths": sorted(out)})


def install_sitemap() -> None:
    """Serve ``Sitemap`` from every HTTP server this process starts from now on."""
    distributed.http.routing.DirectoryHandler = Sitemap
