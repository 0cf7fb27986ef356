"""Operations: infra manifests and images, jobs, schedules, plan, report, benchmarks' dry modes."""
