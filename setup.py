"""Packaging for selfattn_nbdev. Every field comes from settings.ini (nbdev's single source of metadata).

`nbdev_export` writes a pyproject.toml whose `[project] dynamic` list names the fields below; setuptools
requires each of them to be supplied here.
"""
from configparser import ConfigParser

import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

for key in 'lib_name version description author author_email git_url min_python keywords'.split():
    assert key in cfg, f'settings.ini is missing `{key}`'

statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12 3.13 3.14'.split()
min_python = cfg['min_python']

requirements = cfg.get('requirements', '').split()
dev_requirements = cfg.get('dev_requirements', '').split()
hf_requirements = cfg.get('hf_requirements', '').split()
pages_requirements = cfg.get('pages_requirements', '').split()
llamacpp_requirements = cfg.get('llamacpp_requirements', '').split()
lib_path = cfg['lib_path']

# README's pictures are stored beside it (index_files/); PyPI needs absolute addresses for them.
raw = f"https://raw.githubusercontent.com/{cfg['user']}/{cfg['repo']}/{cfg['branch']}/"
long_description = open('README.md', encoding='utf-8').read().replace('](index_files/', '](' + raw + 'index_files/')

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    long_description=long_description,
    long_description_content_type='text/markdown',
    keywords=cfg['keywords'].split(),
    license='Apache-2.0',
    author=cfg['author'],
    author_email=cfg['author_email'],
    url=cfg['git_url'],
    project_urls={'Documentation': f"{cfg['doc_host']}{cfg['doc_baseurl']}", 'Source': cfg['git_url']},
    classifiers=[
        f"Development Status :: {statuses[int(cfg['status'])]}",
        f"Intended Audience :: {cfg['audience'].title()}",
        f"Natural Language :: {cfg['language'].title()}",
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ] + [f'Programming Language :: Python :: {v}' for v in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_packages(include=[lib_path, f'{lib_path}.*']),
    include_package_data=True,
    install_requires=requirements,
    extras_require={'dev': dev_requirements, 'hf': hf_requirements, 'pages': pages_requirements,
                    'llamacpp': llamacpp_requirements},
    python_requires=f'>={min_python}',
    zip_safe=False,
    entry_points={'console_scripts': [], 'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"]},
    scripts=[],
)
